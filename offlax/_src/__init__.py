"""Private implementation of offlax; import names from :mod:`offlax`."""
