"""One model over several machines: pipeline stages on mx.distributed, launched by mlx.launch.

stage.py splits and loads a rank's layers, engine.py runs the app's Engine on a stage, rank.py
is the process mlx.launch starts, serve.py the API over the ranks (`serve --hosts`), remote.py
the app's engine over them, group.py names a lost host, hosts.py reads hosts.json, plan.py plans
for a list of machines, launch.py builds the mlx.launch command. Never imports Qt.
"""
