"""What both lanes share to run work on the engine thread.

``ports``: the executor that runs a callable on the engine thread and the
backend protocol a lane drives there, with the values a backend hands back;
``job``: an engine job in flight (the record the loop and the engine thread
share while a lane's steps run back to back); ``steps``: background steps,
the one way a callable crosses from an asker to the engine thread;
``memory_guard``: does a request fit the memory budget, and the gauge the
engine thread writes after every job.

Neither an actor nor owned by one: the gateway's turn runner, the batch
scheduler, the durability coordinator and the backend import it; it imports
no actor package.
"""

from __future__ import annotations

from .job import AHEAD, EngineJob, job_failure
from .ports import Backend, Executor, InlineExecutor, Registered, StepResult, StepToken
from .steps import BackgroundSteps, StepHandle, StepNotRun

__all__ = [
    "AHEAD",
    "Backend",
    "BackgroundSteps",
    "EngineJob",
    "Executor",
    "InlineExecutor",
    "Registered",
    "StepHandle",
    "StepNotRun",
    "StepResult",
    "StepToken",
    "job_failure",
]
