"""The core layer: the checkpoint format and data model (manifest, file headers, the state-dict
tree, dtypes, tensor buffers), the jobs the trainer hands the writer, and the fault-injection
points. Below everything else; it imports nothing of nostall's above it.
"""
