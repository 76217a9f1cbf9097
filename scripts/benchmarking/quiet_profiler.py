"""Imported before torch: keep torch's profiler (the CPU peak memory of
:func:`benchmarking.timing.peak_memory`) from logging. Kineto prints two lines per profile
("profiler_start", "profiler_stop") at its highest level, 5, and c10 warns once of a block
allocated before the profile began; neither concerns the measurement. c10 reads its level when
torch is imported, Kineto when the profiler first starts."""

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "6")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
