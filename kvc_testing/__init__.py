"""Test and benchmark support, run from a checkout (not shipped in the wheel): the tiny model builder,
managed child processes (own process group, SIGTERM then SIGKILL), and 1P1D cluster helpers."""
