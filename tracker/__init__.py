"""The meshnode tracker: a registry of signed node advertisements with a status page."""
