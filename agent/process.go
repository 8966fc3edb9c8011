package agent

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func noProcessError(pid int) error {
	return &Error{Kind: ErrNoProcess, What: fmt.Sprintf("no process with PID %d", pid),
		Fix: "check the PID with ps; npuprobe must run in the host PID namespace (docker run --pid=host)"}
}

// checkProcess verifies pid names a live process (not one of its threads)
// and returns its status.
func checkProcess(pid int) (processStatus, error) {
	if pid <= 0 {
		return processStatus{}, noProcessError(pid)
	}
	st, err := readStatus(pid)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return st, noProcessError(pid)
		}
		return st, fmt.Errorf("read status of process %d: %w", pid, err)
	}
	if st.Tgid != pid {
		return st, &Error{Kind: ErrNoProcess, What: fmt.Sprintf("%d is a thread of process %d, not a process", pid, st.Tgid),
			Fix: fmt.Sprintf("use --pid %d", st.Tgid)}
	}
	return st, nil
}

// CheckProcess reports, with a user-facing error, whether pid can be traced
// as far as its existence goes. It needs no privilege.
func CheckProcess(pid int) error {
	_, err := checkProcess(pid)
	return err
}

func privilegeError(err error) error {
	return &Error{Kind: ErrPrivilege, What: "not enough privilege to load and attach eBPF programs", Err: err,
		Fix: "run as root, or grant CAP_SYS_ADMIN and CAP_SYS_PTRACE (kernels fixed for CVE-2025-38466 need CAP_SYS_ADMIN to create uprobes; " +
			"older ones accept CAP_BPF with CAP_PERFMON instead, and before 5.11 also need CAP_SYS_RESOURCE)"}
}

// Linux capability numbers (linux/capability.h).
const (
	capSysPtrace = 19
	capSysAdmin  = 21
	capPerfmon   = 38
	capBPF       = 39
)

// checkPrivileges looks at the effective capabilities before anything is
// loaded, so a missing one is reported as such rather than as a failure
// deep inside BPF loading. Loading and attaching need CAP_BPF and
// CAP_PERFMON, or CAP_SYS_ADMIN, which kernels fixed for CVE-2025-38466
// (6.16, and stable backports down to 5.10.240) require to create uprobes:
// which kernel this is cannot be told in advance, so an attach refused with
// EACCES is reported with the same advice. Reading another process's maps
// and root needs CAP_SYS_PTRACE.
func checkPrivileges() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("read capabilities: %w", err)
	}
	has := func(c uint) bool { return data[c/32].Effective&(1<<(c%32)) != 0 }
	var missing []string
	if !has(capSysAdmin) {
		if !has(capBPF) {
			missing = append(missing, "CAP_BPF")
		}
		if !has(capPerfmon) {
			missing = append(missing, "CAP_PERFMON")
		}
	}
	if !has(capSysPtrace) {
		missing = append(missing, "CAP_SYS_PTRACE")
	}
	if len(missing) > 0 {
		return privilegeError(fmt.Errorf("missing %v", missing))
	}
	return nil
}

// WatchExit returns a channel closed when process pid exits. It uses a
// pidfd, which cannot be fooled by PID reuse.
func WatchExit(pid int) (<-chan struct{}, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil, noProcessError(pid)
		}
		return nil, fmt.Errorf("pidfd_open(%d): %w", pid, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer unix.Close(fd)
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			_, err := unix.Poll(fds, -1)
			if err == nil || !errors.Is(err, unix.EINTR) {
				return
			}
		}
	}()
	return done, nil
}
