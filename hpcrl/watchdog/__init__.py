"""The watchdog: decides, for each component, whether it is fine, must be restarted, or has failed for good."""
