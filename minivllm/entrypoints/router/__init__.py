"""Front doors over several engines: the disaggregation proxy (disagg_proxy.py)."""
