"""The service shell: the command line and config, the ``Daemon`` (listeners,
lifecycle), the fleet registry entry, systemd notification, the state gauges.
"""
