package agent

import (
	"bufio"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// A /proc/PID/maps of a process with the fake runtime, as Linux 6.x prints
// it: kernel padding before the path, anonymous lines with and without a
// trailing space, every kind of pseudo-path, and paths that need care.
const realisticMaps = `55d4c7a00000-55d4c7a02000 r--p 00000000 fe:00 1835021                    /usr/bin/segment_workload
55d4c7a02000-55d4c7a03000 r-xp 00002000 fe:00 1835021                    /usr/bin/segment_workload
55d4c8b3e000-55d4c8b5f000 rw-p 00000000 00:00 0                          [heap]
7f3a1c000000-7f3a1c021000 rw-p 00000000 00:00 0 
7f3a1c021000-7f3a20000000 ---p 00000000 00:00 0
7f3a20000000-7f3a20200000 r-xp 00001000 103:05 393256                    /opt/my lib/Ascend  toolkit/libascendcl.so
7f3a20400000-7f3a20600000 r-xp 00002000 00:2d 12345                      /usr/local/Ascend/cann/lib64/libacl_rt.so (deleted)
7f3a20600000-7f3a20601000 rw-s 00000000 00:01 1026                       /dev/zero (deleted)
7f3a20601000-7f3a20602000 r--s 00000000 00:05 77                         /memfd:npu-ipc (deleted)
7f3a20602000-7f3a20603000 rw-p 00000000 00:00 0                          [anon:glibc.malloc]
7ffd5a5d1000-7ffd5a5f2000 rw-p 00000000 00:00 0                          [stack]
7ffd5a5f2000-7ffd5a5f6000 r--p 00000000 00:00 0                          [vvar]
7ffd5a5f6000-7ffd5a5f8000 r-xp 00000000 00:00 0                          [vdso]
7ffff7ff0000-7ffff7ff1000 --xp 00000000 00:00 0                          [uprobes]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
`

func TestParseMaps(t *testing.T) {
	got, err := ParseMaps(strings.NewReader(realisticMaps))
	if err != nil {
		t.Fatal(err)
	}
	want := []Mapping{
		{Start: 0x55d4c7a00000, End: 0x55d4c7a02000, Perms: "r--p", Offset: 0, DevMajor: 0xfe, DevMinor: 0, Inode: 1835021, Path: "/usr/bin/segment_workload"},
		{Start: 0x55d4c7a02000, End: 0x55d4c7a03000, Perms: "r-xp", Offset: 0x2000, DevMajor: 0xfe, DevMinor: 0, Inode: 1835021, Path: "/usr/bin/segment_workload"},
		// Device numbers are hex: 103:05 is major 259 (NVMe).
		{Start: 0x7f3a20000000, End: 0x7f3a20200000, Perms: "r-xp", Offset: 0x1000, DevMajor: 259, DevMinor: 5, Inode: 393256, Path: "/opt/my lib/Ascend  toolkit/libascendcl.so"},
		{Start: 0x7f3a20400000, End: 0x7f3a20600000, Perms: "r-xp", Offset: 0x2000, DevMajor: 0, DevMinor: 0x2d, Inode: 12345, Path: "/usr/local/Ascend/cann/lib64/libacl_rt.so", Deleted: true},
		// Shared anonymous memory and memfds are file-backed too: kept,
		// and never mistaken for the runtime (not executable, not ELF).
		{Start: 0x7f3a20600000, End: 0x7f3a20601000, Perms: "rw-s", Offset: 0, DevMajor: 0, DevMinor: 1, Inode: 1026, Path: "/dev/zero", Deleted: true},
		{Start: 0x7f3a20601000, End: 0x7f3a20602000, Perms: "r--s", Offset: 0, DevMajor: 0, DevMinor: 5, Inode: 77, Path: "/memfd:npu-ipc", Deleted: true},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseMaps:\n got %+v\nwant %+v", got, want)
	}
}

func TestParseMapsEmptyAndLongLines(t *testing.T) {
	got, err := ParseMaps(strings.NewReader(""))
	if err != nil || len(got) != 0 {
		t.Errorf("empty maps: %v, %v", got, err)
	}
	// PATH_MAX-long paths (4096) are longer than bufio's default token.
	long := "/" + strings.Repeat("d/", 3000) + "libascendcl.so"
	got, err = ParseMaps(strings.NewReader("7f0000000000-7f0000001000 r-xp 00000000 08:01 42 " + long + "\n"))
	if err != nil || len(got) != 1 || got[0].Path != long {
		t.Errorf("long path: %d mappings, err %v", len(got), err)
	}
}

func TestParseMapsErrors(t *testing.T) {
	good := "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /lib/x.so\n"
	cases := []struct {
		line string
		want string // in the error, after "maps line 3: "
	}{
		{"garbage", "too few fields"},
		{"7f0000000000-7f0000001000 r-xp 00000000 08:01", "too few fields"},
		{"7f0000000000 r-xp 00000000 08:01 42 /lib/x.so", "bad address range"},
		{"zz-7f0000001000 r-xp 00000000 08:01 42 /lib/x.so", "bad start address"},
		{"7f0000000000-7f00000010000000000 r-xp 00000000 08:01 42 /lib/x.so", "bad end address"},
		{"7f0000000000-7f0000001000 r-xp 0000000g 08:01 42 /lib/x.so", "bad offset"},
		{"7f0000000000-7f0000001000 r-xp 00000000 0801 42 /lib/x.so", "bad device"},
		{"7f0000000000-7f0000001000 r-xp 00000000 08:zz 42 /lib/x.so", "bad device"},
		{"7f0000000000-7f0000001000 r-xp 00000000 08:01 -1 /lib/x.so", "bad inode"},
		{"7f0000000000-7f0000001000 r-xp 00000000 08:01 4x2 /lib/x.so", "bad inode"},
	}
	for _, c := range cases {
		_, err := ParseMaps(strings.NewReader(good + good + c.line + "\n" + good))
		if err == nil {
			t.Errorf("%q: no error", c.line)
			continue
		}
		if !strings.HasPrefix(err.Error(), "maps line 3: ") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %q, want \"maps line 3: ...%s...\"", c.line, err, c.want)
		}
	}
}

func TestParseEnviron(t *testing.T) {
	raw := []byte("LD_LIBRARY_PATH=/usr/local/Ascend/cann/lib64:/opt/x\x00" +
		"ASCEND_RT_VISIBLE_DEVICES=0,1\x00" +
		"OPTS=a=b=c\x00" + // only the first '=' separates
		"EMPTY=\x00" +
		"NOEQUALS\x00" + // not a variable: skipped
		"=nokey\x00" + // no name: skipped
		"SPACE=has space\x00" +
		"\x00") // environ ends with a NUL; a stray empty entry is harmless
	got := ParseEnviron(raw)
	want := map[string]string{
		"LD_LIBRARY_PATH":           "/usr/local/Ascend/cann/lib64:/opt/x",
		"ASCEND_RT_VISIBLE_DEVICES": "0,1",
		"OPTS":                      "a=b=c",
		"EMPTY":                     "",
		"SPACE":                     "has space",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseEnviron:\n got %q\nwant %q", got, want)
	}
	if got := ParseEnviron(nil); len(got) != 0 {
		t.Errorf("ParseEnviron(nil) = %v", got)
	}
}

// ReadEnviron returns exactly the environment a process was started with.
func TestReadEnvironOfChild(t *testing.T) {
	cmd := exec.Command("cat")
	cmd.Env = []string{"LD_LIBRARY_PATH=/a b:/c", "NPUPROBE_X=a=b", "EMPTY="}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); cmd.Wait() })
	// Start returns once execve is past its point of no return, which is
	// before the kernel records where the new environment lies; an echo
	// proves cat is running.
	if _, err := io.WriteString(stdin, "x\n"); err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "x\n" {
		t.Fatalf("cat echoed %q, %v", line, err)
	}
	env, err := ReadEnviron(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"LD_LIBRARY_PATH": "/a b:/c", "NPUPROBE_X": "a=b", "EMPTY": ""}
	if !reflect.DeepEqual(env, want) {
		t.Errorf("ReadEnviron = %q, want %q", env, want)
	}
}

const realisticStatus = `Name:	segment_workloa
Umask:	0022
State:	S (sleeping)
Tgid:	4242
Ngid:	0
Pid:	4242
PPid:	4100
TracerPid:	0
Uid:	0	0	0	0
Gid:	0	0	0	0
FDSize:	64
Groups:	0 
NStgid:	4242	17	1
NSpid:	4242	17	1
NSpgid:	4242	17	1
NSsid:	4100	1	1
Threads:	4
VmRSS:	   10240 kB
`

func TestParseStatus(t *testing.T) {
	st, err := parseStatus(strings.NewReader(realisticStatus))
	if err != nil {
		t.Fatal(err)
	}
	want := processStatus{Name: "segment_workloa", Tgid: 4242, NSpid: []int{4242, 17, 1}}
	if !reflect.DeepEqual(st, want) {
		t.Errorf("parseStatus = %+v, want %+v", st, want)
	}

	// A thread's status: its own PID differs from Tgid; comm may hold
	// spaces and colons; the host namespace has a single NSpid level.
	thread := "Name:\tpt_main thread:1\nTgid:\t100\nPid:\t103\nNSpid:\t103\n"
	st, err = parseStatus(strings.NewReader(thread))
	if err != nil {
		t.Fatal(err)
	}
	want = processStatus{Name: "pt_main thread:1", Tgid: 100, NSpid: []int{103}}
	if !reflect.DeepEqual(st, want) {
		t.Errorf("parseStatus = %+v, want %+v", st, want)
	}

	for _, bad := range []string{"Tgid:\tabc\n", "Tgid:\t\n", "NSpid:\t1\tx\t3\n"} {
		if _, err := parseStatus(strings.NewReader(bad)); err == nil {
			t.Errorf("parseStatus(%q): no error", bad)
		}
	}
}

// checkProcess against a fake procfs: the errors users see for a PID that
// does not exist and for the PID of a thread.
func TestCheckProcessFakeProc(t *testing.T) {
	root := t.TempDir()
	write := func(pid, text string) {
		dir := filepath.Join(root, pid)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "status"), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("100", "Name:\tpython\nTgid:\t100\nNSpid:\t100\t7\n")
	write("103", "Name:\tpython\nTgid:\t100\nNSpid:\t103\t9\n")
	old := procRoot
	procRoot = root
	t.Cleanup(func() { procRoot = old })

	st, err := checkProcess(100)
	if err != nil || st.Name != "python" || !reflect.DeepEqual(st.NSpid, []int{100, 7}) {
		t.Errorf("checkProcess(100) = %+v, %v", st, err)
	}
	_, err = checkProcess(103)
	if !errors.Is(err, ErrNoProcess) || !strings.Contains(err.Error(), "103 is a thread of process 100") ||
		!strings.Contains(err.Error(), "use --pid 100") {
		t.Errorf("checkProcess(thread) = %v", err)
	}
	for _, pid := range []int{0, -1, 999} {
		if err := CheckProcess(pid); !errors.Is(err, ErrNoProcess) {
			t.Errorf("CheckProcess(%d) = %v, want ErrNoProcess", pid, err)
		}
	}
}
