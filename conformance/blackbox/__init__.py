"""Black-box power loss: a backend's system calls recorded out of process with strace,
rebuilt into the crash states a power cut may leave (the ALICE approach).

=====================  ===============================================================
module                 holds
=====================  ===============================================================
strace_trace           reading ``strace -f -y -tt -xx`` output into exact system calls
syscall_events         those calls as the I/O seam's trace events, plus the child's markers
traced_workload        running a workload in a child under strace; the recording
=====================  ===============================================================

The check itself is ``conformance.checks.blackbox_power_loss_check``.
"""
