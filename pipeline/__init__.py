"""The spine of slipstream: the Sample record, the wire protocol, configs, models and net helpers
(imported by every stage), and, in pipeline/orchestration/, the Ray launcher on top (imports the
stages; nothing imports it back)."""
