"""Progress of long calls (``from_pretrained``, ``load_pretrained``, ``save_pretrained``,
``verify``): a tqdm bar on rank 0, as transformers shows one, and a line for the ``tpfn`` logger.

A bar shows on the rank 0 of the default process group (or alone) unless the call says
``progress=False``, or ``TPFN_PROGRESS=0`` or ``HF_HUB_DISABLE_PROGRESS_BARS=1`` (transformers'
switch) is set; ``progress=True`` shows it on every rank. As transformers does, it shows
whether or not stderr is a terminal (tqdm redraws one line there, and prints a few lines to a
log). Without tqdm installed there is no bar; the log lines stay.

>>> with Progress("copy", total=4000, enabled=False) as bar:
...     bar.update(4000, "2/2 tensors")
>>> bar.done, size(bar.done), bar.seconds >= 0
(4000, '4.0 kB', True)
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch.distributed as dist

__all__ = ["Progress", "enabled", "log", "size"]

log = logging.getLogger("tpfn")


def size(n: int) -> str:
    """Bytes as people read them: ``'512 B'``, ``'1.3 MB'`` (powers of 1000, as tqdm's bar)."""
    unit = "B"
    for bigger in ("kB", "MB", "GB", "TB"):
        if n < 1000:
            break
        n, unit = n / 1000, bigger
    return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"


def enabled(progress: bool | None) -> bool:
    """Whether a call given ``progress`` shows a bar on this rank."""
    if progress is not None:
        return bool(progress)
    off = (os.environ.get("TPFN_PROGRESS", "1").strip() in ("0", "false", "False", "no")
           or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("1", "true", "yes", "on"))
    return not off and (not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0)


class Progress:
    """A bar of ``total`` units (``unit="B"``: bytes, shown scaled) named ``what``, updated with
    ``update(n, note)``; ``done`` and ``seconds`` say how far and how long, for the log."""

    def __init__(self, what: str, total: int, *, unit: str = "B", enabled: bool = True):
        self.what, self.total, self.unit, self.done = what, total, unit, 0
        self.bar, self.end = None, None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # no tqdm: the log lines only
                return

            class Bar(tqdm):
                monitor_interval = 0  # no monitor thread: verify forks its ranks while a bar is up

            self.bar = Bar(total=total, desc=what, unit=unit, unit_scale=unit == "B",
                           unit_divisor=1000, disable=False, file=sys.stderr, leave=True)

    def __enter__(self) -> "Progress":
        self.start = time.perf_counter()
        return self

    def update(self, n: int, note: str | None = None) -> None:
        self.done += n
        if self.bar is not None:
            if note is not None:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)

    @property
    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def __exit__(self, *exc) -> None:
        self.end = time.perf_counter()
        if self.bar is not None:
            self.bar.close()
