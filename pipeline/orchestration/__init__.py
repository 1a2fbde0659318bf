"""The top layer: starting the stages as Ray actors, driving and healing a run, its metrics and progress.

Nothing below (pipeline's record, wire, config, models; stages/; buffer/) imports from here.
"""
