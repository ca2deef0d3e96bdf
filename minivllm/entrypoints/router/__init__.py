"""Servers in front of several engines: the replica router (``minivllm router``)."""
