# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Commands above every room: the fault matrix and the production-shape terms."""
