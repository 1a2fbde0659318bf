"""A generator actor that starts before the trainer's weight sender exists (SGLang's servers start first:
the sender needs their addresses) takes pushes once the driver connects it (weights.transport cpu;
GeneratorStage.connect_weights). The torch engine stands in for SGLang's servers here."""

from __future__ import annotations


def test_a_generator_started_without_a_weight_address_applies_pushes_once_connected(tmp_path, ray_session):
    import ray

    from buffer.net import free_port
    from pipeline.config import load_config
    from pipeline.orchestration.actors import GeneratorActor
    from stages.weights.zmq_transport import ZmqWeightSender

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "run.timeout_s=60"])
    sender = ZmqWeightSender(timeout_s=30, min_engines=1)
    buffer = f"tcp://127.0.0.1:{free_port()}"  # never reached: the actor generates nothing here
    actor = GeneratorActor.options(num_cpus=1).remote(cfg, 0, buffer, None, 4)
    try:
        assert ray.get(actor.stats.remote(), timeout=120)["engine_version"] == 0
        ray.get(actor.connect_weights.remote(sender.address), timeout=60)
        sender.push(3, []).result()  # an empty update still carries its version
        assert ray.get(actor.stats.remote(), timeout=60)["engine_version"] == 3
    finally:
        ray.kill(actor)
        sender.close()


def test_a_generator_whose_version_0_is_elsewhere_generates_nothing_before_the_first_push(
    tmp_path, ray_session
):
    """trainer.lora.init_from: version 0 is the base plus the folder's adapters, not the model folder the
    engine loaded, so run() starts no group until the trainer's first push is applied."""
    import time

    import ray

    from buffer.net import free_port
    from pipeline.config import load_config
    from pipeline.orchestration.actors import GeneratorActor
    from stages.weights.zmq_transport import ZmqWeightSender

    overrides = [
        f"run.dir={tmp_path / 'run'}",
        "run.timeout_s=60",
        "trainer.lora.rank=4",
        "trainer.lora.init_from=/peft",
    ]
    cfg = load_config(None, overrides)
    sender = ZmqWeightSender(timeout_s=30, min_engines=1)
    buffer = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: a group that got this far would wait there
    actor = GeneratorActor.options(num_cpus=1).remote(cfg, 0, buffer, sender.address, 4)
    try:
        ray.get(actor.ident.remote(), timeout=120)  # built (engine loaded): run() starts at once now
        actor.run.remote()  # ended with the actor below
        time.sleep(3.0)
        assert ray.get(actor.stats.remote(), timeout=60)["groups_started"] == 0
        sender.push(0, []).result()
        deadline = time.monotonic() + 60
        while ray.get(actor.stats.remote(), timeout=60)["groups_started"] == 0:
            assert time.monotonic() < deadline, "no group started after the first push"
            time.sleep(0.2)
    finally:
        ray.kill(actor)
        sender.close()
