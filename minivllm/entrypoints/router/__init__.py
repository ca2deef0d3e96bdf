"""Servers in front of several engines: the replica router (``minivllm router``) and the
disaggregation proxy (``minivllm disagg-proxy``)."""
