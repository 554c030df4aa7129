# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The production-shape mode: megatron-core's real code at production sizes, without the memory."""
