"""The megatron-core trainer stage: continuous consumption of complete groups from a BatchSource,
off-policy-corrected policy-gradient losses, versioned optimizer steps and non-blocking weight pushes.

Public API (imports are lazy: importing this package does not import torch or megatron):

    from stages.trainer.trainer import Trainer, SourceExhausted
    from stages.trainer.config import TrainerConfig, TrainerRun
    trainer = Trainer(tc: TrainerConfig, run: TrainerRun, source: BatchSource | None, model_path: str,
                      *, weights: WeightsConfig | None = None, sender: WeightSender | None = None,
                      backend: TrainBackend | None = None)
        # joins torch.distributed (torchrun env, or a gloo/NCCL world of 1 on a free port), builds the
        # model from the HF folder (megatron by default), resumes from <run.run_dir>/checkpoints/latest if
        # present (trainer.resume), announces trainer.version to the source. `source`: rank 0 only.
        # pipeline.config.trainer_run(cfg, run_dir) fills TrainerRun from a whole RunConfig.
    trainer.attach_sender(sender)      # rank 0; pushes every weights.push_every steps
    metrics = trainer.step()           # collective: fetch -> logp_old -> loss -> step -> version += 1
    trainer.train_on_batch(batch)      # the same without fetching (pyarrow RecordBatch, ARROW_SCHEMA)
    trainer.version                    # int, = optimizer steps taken (0 = the initial weights)
    trainer.push_weights() / wait_push() / save_checkpoint() / save_hf(dir) / close()

    from stages.trainer.loop import run; run(trainer, steps)   # the continuous loop + metrics JSONL
    python -m stages.trainer --config X.yaml [a.b=c] (--buffer tcp://... | --replay DIR)

The Trainer's parts: feed (fetch + rank broadcast + catch-up pushes), backend (the TrainBackend and
ScheduleRunner seams) with megatron_backend (its megatron-core implementation), critic (the value
model of advantage=ppo), checkpoint (CheckpointManager over Stateful parts), step_metrics (the step's
figures), optimizer (megatron's optimizer, the lr schedule), stages/weights/publisher.py (pushes).
Other modules: cpu_shim (CUDA-less megatron), hf_mapping (HF <-> megatron names/layouts), model
(build, logprobs), export (gather to HF on rank 0, save_pretrained folder), packing (Arrow ->
micro-batches), losses (pure torch), replay (recorded buffer directory), config_file (the stage's
sections of a YAML config, for `python -m stages.trainer`).
"""
