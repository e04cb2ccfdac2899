"""Tensor parallelism: one replica's model sharded over N GPUs of one node.

placement.py  the replica's placement group (one bundle per rank)
sharding.py   which slice of each weight and adapter a rank holds
wire.py       a step's inputs and adapter loads, rank 0 → ranks 1…N−1
group.py      what every rank shares: its spec, the process group, building its shard
workers.py    ranks 1…N−1 (Ray actors or spawned processes)
model.py      rank 0: the model the engine drives, and its adapter slots that load every shard
"""
