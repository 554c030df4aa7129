# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Real torch.distributed ranks on CPU: the launcher and the fork server sharing its setup."""
