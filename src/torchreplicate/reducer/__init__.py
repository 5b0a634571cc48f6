"""One synchronised backward's reduction: gradient hooks, buckets, collectives, the end of backward.

``Reducer`` owns the step; buckets and slots, where ``.grad`` lives, how a
bucket travels (all-reduce or a comm hook), the flags each rank sends, and
the bucket layout (layout/) are its parts. It reports where it is to the
stall watchdog (``faults/``) and imports neither the module state
(``core/``) nor the observers (``observe/``).
"""
