"""The NVMe tier: optimizer state on a local disk (`tier.NVMeTier`), one concern per module."""
