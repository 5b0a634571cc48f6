"""The bucket layout: which gradients travel together, and in what order.

plan.py lays buckets out from sizes and an order (DDP's rules, the fixed
and tuned ones); policy.py holds what a reducer knows and learns in its
first step (the launch order, the cap, the schedule, the tied split's
price); link.py times the link for the tuned layout.
"""
