"""Schedules as data: actions, generators, lowering passes and verification."""

from lightning_pipe.schedules.actions import Action, Kind, format_actions, parse_actions
from lightning_pipe.schedules.generators import forward_only, gpipe, one_f_one_b
from lightning_pipe.schedules.passes import (
    Schedule,
    build_inference,
    build_schedule,
    receive_order,
    two_bw_arrivals,
    two_bw_drain,
    two_bw_run,
    two_bw_stage_drain,
    two_bw_stage_window,
    two_bw_window,
)
from lightning_pipe.schedules.registry import (
    SCHEDULE_NAMES,
    SCHEDULES,
    ScheduleSpec,
    check_name,
    flushed_generator,
    get,
)
from lightning_pipe.schedules.verify import verify

__all__ = [
    "Action",
    "Kind",
    "SCHEDULE_NAMES",
    "Schedule",
    "SCHEDULES",
    "ScheduleSpec",
    "build_inference",
    "build_schedule",
    "check_name",
    "format_actions",
    "forward_only",
    "gpipe",
    "one_f_one_b",
    "parse_actions",
    "receive_order",
    "flushed_generator",
    "get",
    "two_bw_arrivals",
    "two_bw_drain",
    "two_bw_run",
    "two_bw_stage_drain",
    "two_bw_stage_window",
    "two_bw_window",
    "verify",
]
