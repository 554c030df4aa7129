# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""CUDA's rules on the host: placement, streams and events, p2p matching, CUDA-only calls."""
