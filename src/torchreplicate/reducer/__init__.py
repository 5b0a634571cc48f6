"""One synchronised backward's reduction: gradient hooks, buckets, collectives, the end of backward.

``Reducer`` owns the step; buckets and slots, where ``.grad`` lives, how a
bucket travels (all-reduce or a comm hook), the flags each rank sends, launch
order and bucket size, and the stall watchdog are its parts. Nothing here
imports the module state (``core/``) or the observers (``observe/``).
"""
