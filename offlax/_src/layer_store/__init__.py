"""The layer store: stacked layers' params, gradients and optimizer state on disk
(`store.LayerStore`), one concern per module."""
