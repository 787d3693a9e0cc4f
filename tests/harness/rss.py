"""Peak host-memory growth of this process while a block runs, for memory tests: the kernel's own count
of anonymous resident memory (/proc/self/status RssAnon), sampled every 0.5 ms on a thread — an
independent measurement, not zerospeed's counters (Linux only)."""

from __future__ import annotations

import threading
import time


def anon_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


class PeakSampler:
    """`with PeakSampler() as s: ...` then `s.growth_bytes`: the peak RssAnon growth over the block."""

    def __enter__(self):
        self.base = self.peak = anon_rss_kib()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, anon_rss_kib())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, anon_rss_kib())

    @property
    def growth_bytes(self) -> int:
        return (self.peak - self.base) * 1024
