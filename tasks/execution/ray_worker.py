"""What every worker process of a stage's Ray job runs before its task or actor (the job's
`worker_process_setup_hook`, set by ray_launch): apart from ray_launch, so that Ray Train's helper actors, which run
it too, import nothing more than `logging`."""

from __future__ import annotations

import logging

# Ray Train's placement-group cleaner asks the dashboard's state API about once a second whether the run's controller
# still lives. On a cluster started without the dashboard that API never answers, and the warning the cleaner logs
# each time reached the stage's output for as long as the stage ran (ten lines every five seconds). The driver ends
# its run's controller itself (ray_launch._stage_trainer), so nothing is lost by not hearing it.
CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
STATE_API_WARNING = "Failed to query Ray Train Controller actor state"


def quiet_the_cleaners_state_api_warning() -> None:
    logging.getLogger(CLEANER_LOGGER).addFilter(lambda record: STATE_API_WARNING not in record.getMessage())
