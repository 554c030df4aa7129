# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Measurement: allocator-level host memory counters, the peak's tensors, retained origins."""
