"""The spine of slipstream: the Sample record, the wire protocol, configs, and Ray orchestration."""
