"""The fault campaign's parts: servers, the worker fleet, the fault schedule, the checker.

``scripts/chaos.py`` is the command line; ``tests/test_chaos.py`` runs a reduced
campaign through :func:`chaos_lib.campaign.run_campaign`.
"""
