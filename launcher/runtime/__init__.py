"""Code that runs inside a rank (`python -m launcher.runtime.entry`, started by torchrun).

torch is imported once, at the rank's door: `entry` (and `doctor_rank`, a doctor rank's program)
creates the rank's recorder from torch-free modules and only then imports the modules that need
torch, so the heartbeat beats and the summary can be written while torch loads (1-2 s of
import time, a hang on a slow file system, a broken install are all recorded). Behind that door
the modules import torch at module level and use its types.

Torch-free, because something imports them before the door or without torch:
  entry, doctor_rank   the doors themselves
  context              who the rank is (the recorder needs it); `device` and `init_distributed`
                       import torch when called, which is after the door
  preemption           the stop flag entry reads however the rank ended
  recorder, meter      also used by plain torchrun scripts (`StepMeter`)
  bootstrap            the door of a plain script: it measures the script through torch's hooks

Behind the door, torch submodules with a noticeable import of their own (on top of torch, on a
2-core host: Dynamo 1.4 s, DCP 0.9 s, DTensor 0.8 s, FSDP2 0.6 s)
are imported inside the function that needs them, so a run that never compiles, checkpoints or
shards does not load them (DDP's constructor loads all but DCP itself).

Never imports cli, backends, jobs or report.
"""
