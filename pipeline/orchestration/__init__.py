"""The top layer: starting the stages as Ray actors, driving and healing a run, its metrics and progress.

    launcher     the top of a run (run_pipeline): run directory, Ray, start, train, shutdown, outcome
    driver       Pipeline: the supervisors started in order, the training loop, the shutdown
    supervisors  BufferStage, GeneratorStage, TrainerGroup: start() and restart() of each stage
    healing      Healer: the step watch, the restart budget, and which deaths are restarted
    calls        StageFailed and Calls: every wait on an actor, with the run's timeout and the stage named
    actors       the Ray actors hosting each stage object
    placement    the placement group's bundles and the GPUs each actor drives

Nothing below (pipeline.config; stages/; buffer/) imports from here.
"""
