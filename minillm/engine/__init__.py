"""The engine: requests in, one step at a time, outputs out (chapters 02–11).

- `core.LLMEngine` — `step()` (schedule → execute → update → record) and rollback of a failed step.
- `input.InputProcessor` — tokenize and check a prompt and its parameters into a `Request`.
- `output.OutputProcessor` — final text, stop strings, what each output carries (deltas).
- `inbox.EngineInbox` — the inbox through which other threads talk to a running engine.
- `build.build_engine` — one engine from a config (used by `LLM`, the simulator and the graders);
  `parts.make_kv_manager` / `make_scheduler` — the KV manager and scheduler a config names.
"""

from minillm.engine.build import build_engine
from minillm.engine.core import EngineLoad, LLMEngine, StepUpdates
from minillm.engine.inbox import ADD_FAILED, SERVER_FAULTS, STEP_FAILED, OutputSink
from minillm.engine.parts import make_kv_manager, make_scheduler

__all__ = ["ADD_FAILED", "SERVER_FAULTS", "STEP_FAILED", "EngineLoad", "LLMEngine", "OutputSink", "StepUpdates", "build_engine",
           "make_kv_manager", "make_scheduler"]
