"""When a rank stops: the stall watchdog, the roll call of the ranks, and where each rank is (``Place``).

The reducer marks each rank's place in its step; when a collective waits
too long or its transport fails, the watchdog reads every rank's note and
turns the failure into one error naming who is where. Imports nothing
above it: the reducer and the module state call in.
"""
