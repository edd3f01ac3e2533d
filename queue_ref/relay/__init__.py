"""``queue-ref relay``: an SMTP relay (MTA) around any Storage backend.

Split the way Postfix splits its programs, each part small and testable alone:

* ``relay_config``     the TOML configuration, Postfix's names and defaults
* ``smtp_receiver``    the SMTP server (aiosmtpd): policy, limits, 250 only after commit
* ``mx_routing``       relayhost, transport map, MX by dnspython (implicit and null MX)
* ``smtp_delivery``    the SMTP client (aiosmtplib): STARTTLS, connection reuse
* ``delivery_scheduler``  due entries, per-destination and global concurrency, outcomes
* ``retry_backoff``    when a deferred recipient is tried again, and when it expires
* ``dsn_bounce``       RFC 3464 delivery status notifications
* ``delivery_log``     one line per delivery attempt, and its JSON twin
* ``relay_metrics``    Prometheus metrics on a loopback port
* ``relay_server``     the process: start, signals, orderly stop
* ``relay_command``    the ``queue-ref relay`` command
"""
