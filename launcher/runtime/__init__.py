"""Code that runs inside a rank (`python -m launcher.runtime.entry`, started by torchrun).

Modules here import torch inside their functions, never at module level: `entry` imports them
all before the rank's recorder exists, and the recorder must already be beating and able to
write the rank's summary while torch loads, since seconds of import time, a hang on a slow file
system or a broken install are all recorded then. (`live_bytes` is the exception: benchmarks use
it, never a rank.)

Never imports cli, backends, jobs or report.
"""
