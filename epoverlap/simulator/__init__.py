"""The schedule simulator: the executor's plans replayed on simulated lanes, to see what overlap
buys at shapes, EP sizes and links that were never run.

`engine` replays a plan (the executor's lane and event rules, the host, the all-to-alls that
couple the EP group); `costs` says how long each action takes (recorded spans, a link model,
FLOP counts); `scenario` assembles one simulation's inputs from the command's options and runs
its modes; `replay` turns the runs into figures and compares them with a recorded run. The
command is epoverlap/cli/simulate.py.
"""
