"""Host-side helpers of the `sglang_server` role: the no-systemd process supervisor and log diagnosis."""
