"""What the machine is doing and can do: how busy other processes keep it (a measurement taken in a
contended moment is used for that run only, never cached) and how fast it reads memory (the floor a
one-token step of a memory-bound decoder could reach)."""
from __future__ import annotations

import mmap
import os
import resource
import time

import torch

CONTENDED_CORES = 0.15  # other processes' average CPU use (in cores) above which a measurement is contended
# ... and at least this much of their CPU time in all: /proc/stat counts whole clock ticks, so over a very
# short window a single tick of another process would read as whole cores
CONTENDED_MIN_CPU_S = 0.05


def cpu_counters() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    return busy, mine


def machine_load(start: tuple[float, float], wall_s: float) -> dict:
    """How busy the machine was with OTHER work since `start` (`cpu_counters()`): the same code measured
    0.75x AR idle and 2.40x AR beside a training job (contention flattens the cost curve). A contended
    interval is marked (others used more than CONTENDED_CORES on average)."""
    busy, mine = cpu_counters()
    others = max(0.0, (busy - start[0]) - (mine - start[1]))
    cores = others / max(wall_s, 1e-9)
    return {"wall_s": round(wall_s, 2), "own_cpu_s": round(mine - start[1], 2), "others_cpu_s": round(others, 2),
            "others_cores": round(cores, 3), "own_cpu_per_wall": round((mine - start[1]) / max(wall_s, 1e-9), 3),
            "loadavg": list(os.getloadavg()),
            "contended": bool(cores > CONTENDED_CORES and others >= CONTENDED_MIN_CPU_S)}


class LoadMeter:
    """`with LoadMeter() as m: ...` then `m.load` (machine_load over the block)."""

    def __enter__(self) -> "LoadMeter":
        self.start, self.t0, self.load = cpu_counters(), time.perf_counter(), None
        return self

    def __exit__(self, *exc) -> None:
        self.load = machine_load(self.start, time.perf_counter() - self.t0)


def _probe_buffer(n: int, dev: torch.device) -> tuple[torch.Tensor, object]:
    """n float32 ones for the bandwidth probe, and what keeps their memory alive. On a CPU the memory is mapped
    with 2 MB pages where the OS grants them (Linux `madvise`): a plain allocation gets 4 KB or 2 MB pages by
    the process's history, and on a VM a sum over 2 MB pages read ~13 % faster (alternating in one process)."""
    if dev.type == "cpu" and hasattr(mmap, "MADV_HUGEPAGE"):
        m = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KB pages
            pass
        return torch.frombuffer(m, dtype=torch.float32).fill_(1.0), m
    return torch.ones(n, dtype=torch.float32, device=dev), None


@torch.no_grad()
def memory_read_gbs(mbytes: int = 256, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Memory read bandwidth in GB/s: the best of `repeats` sums over a `mbytes` MB buffer (far larger than
    any cache; the sum's arithmetic is far below what the cores can do, so reading is the limit), about a
    second on a CPU. A one-token step must read every weight once, so weight bytes / step time over this
    figure says how close the step is to the hardware's floor (the buffer on 2 MB pages where the OS has them,
    so a reading does not depend on the pages an allocation happened to get; a VM's host still moves it)."""
    dev = torch.device(device)
    buf, held = _probe_buffer(mbytes * (1 << 20) // 4, dev)
    times = []
    for _ in range(repeats + 1):  # the first pass faults the pages in
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        buf.sum()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    del buf, held  # the mapping goes with its last view
    return mbytes * (1 << 20) / min(times[1:]) / 1e9


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (tied weights counted once): what a one-token step reads."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total

