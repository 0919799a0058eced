"""The released model on PyTorch's meta device: its step's placement, host syncs, FLOPs and memory counted by the
real code (``runtime``: the stand-ins, ``step``: the paths and their budgets), every other stage of a clip
(``stages``), and the seconds those counts **project** to (``projection``), printed by ``h3serve plan`` (``report``).
"""
