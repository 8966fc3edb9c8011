package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// The control API lets a user (or `npuprobe dump` in a distroless image,
// which has no shell to send signals from) ask a running npuprobe for
// snapshots. It has no authentication, so it listens only where asked:
// a unix socket that only its owner (root) may connect to, and, if asked,
// HTTP on a loopback address.
//
//	POST /dump[?pid=N]  snapshot every traced process (or one); answers {"paths": [...]}
//	GET  /status        the status line and the traced processes

const defaultControlPath = "/run/npuprobe/control.sock"

// dumpTimeout bounds how long a dump request waits for the event loop.
const dumpTimeout = 2 * time.Minute

type dumpReply struct {
	Paths []string `json:"paths"`
	Error string   `json:"error,omitempty"`
}

type controlServer struct {
	srv       *http.Server
	listeners []net.Listener
	sockPath  string
}

// startControl opens the listeners asked for; either may be empty.
func startControl(s *session, sockPath, httpAddr string) (*controlServer, error) {
	c := &controlServer{}
	mux := http.NewServeMux()
	mux.HandleFunc("/dump", func(w http.ResponseWriter, r *http.Request) { handleDump(s, w, r) })
	mux.HandleFunc("/status", func(w http.ResponseWriter, r *http.Request) { handleStatus(s, w) })
	c.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if sockPath != "" {
		l, err := listenUnix(sockPath)
		if err != nil {
			return nil, err
		}
		c.listeners = append(c.listeners, l)
		c.sockPath = sockPath
	}
	if httpAddr != "" {
		if err := requireLoopback(httpAddr); err != nil {
			c.close()
			return nil, err
		}
		l, err := net.Listen("tcp", httpAddr)
		if err != nil {
			c.close()
			return nil, fmt.Errorf("--control-http %s: %w", httpAddr, err)
		}
		c.listeners = append(c.listeners, l)
	}
	for _, l := range c.listeners {
		go c.srv.Serve(l)
	}
	return c, nil
}

func (c *controlServer) close() {
	if c == nil {
		return
	}
	c.srv.Close()
	for _, l := range c.listeners {
		l.Close()
	}
	if c.sockPath != "" {
		os.Remove(c.sockPath)
	}
}

// listenUnix creates the control socket, mode 0600 in a directory only
// root can enter, replacing a stale socket (never another kind of file).
func listenUnix(path string) (net.Listener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("--control %s: %w", path, err)
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("--control %s: exists and is not a socket (remove it or choose another path)", path)
		}
		if conn, err := net.Dial("unix", path); err == nil {
			conn.Close()
			return nil, fmt.Errorf("--control %s: another npuprobe is listening there", path)
		}
		os.Remove(path)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("--control %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("--control %s: %w", path, err)
	}
	return l, nil
}

// requireLoopback refuses addresses other machines could reach.
func requireLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("--control-http %s: %w", addr, err)
	}
	ip := net.ParseIP(host)
	if host == "localhost" || (ip != nil && ip.IsLoopback()) {
		return nil
	}
	return fmt.Errorf("--control-http %s: only a loopback address is allowed (127.0.0.1:PORT or [::1]:PORT): the control API has no authentication", addr)
}

func handleDump(s *session, w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST /dump", http.StatusMethodNotAllowed)
		return
	}
	var pid int
	if v := r.URL.Query().Get("pid"); v != "" {
		var err error
		if pid, err = strconv.Atoi(v); err != nil || pid <= 0 {
			writeJSON(w, http.StatusBadRequest, dumpReply{Error: "bad pid " + strconv.Quote(v)})
			return
		}
	}
	res := make(chan dumpReply, 1)
	req := request{reason: "request", at: s.clk.Monotonic(), pid: pid, reply: res}
	ctx, cancel := context.WithTimeout(r.Context(), dumpTimeout)
	defer cancel()
	select {
	case s.requests <- req:
	case <-ctx.Done():
		writeJSON(w, http.StatusServiceUnavailable, dumpReply{Error: "npuprobe is busy"})
		return
	}
	select {
	case rep := <-res:
		code := http.StatusOK
		if rep.Error != "" {
			code = http.StatusNotFound
		}
		writeJSON(w, code, rep)
	case <-ctx.Done():
		writeJSON(w, http.StatusGatewayTimeout, dumpReply{Error: "no snapshot within " + dumpTimeout.String()})
	}
}

func handleStatus(s *session, w http.ResponseWriter) {
	writeJSON(w, http.StatusOK, s.metrics.statusSnapshot())
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

// runDump is `npuprobe dump`: ask a running npuprobe for snapshots and
// print the files written, one per line.
func runDump(args []string, stdout, stderr io.Writer) int {
	var sock, httpAddr string
	var pid int
	fs := newFlags("dump", stderr)
	fs.StringVar(&sock, "control", defaultControlPath, "control socket of the running npuprobe (its --control)")
	fs.StringVar(&httpAddr, "control-http", "", "or its --control-http address")
	fs.IntVar(&pid, "pid", 0, "snapshot only this traced process (default: every one)")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	client := &http.Client{Timeout: dumpTimeout + 10*time.Second}
	base := "http://" + httpAddr
	where := httpAddr
	if httpAddr == "" {
		base, where = "http://npuprobe", sock
		client.Transport = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}}
	}
	url := base + "/dump"
	if pid != 0 {
		url += "?pid=" + strconv.Itoa(pid)
	}
	resp, err := client.Post(url, "application/json", nil)
	if err != nil {
		var opErr *net.OpError
		if errors.As(err, &opErr) {
			err = opErr.Err
		}
		return fail(stderr, fmt.Errorf("cannot reach npuprobe at %s: %v (is it running with --control %s?)", where, err, where))
	}
	defer resp.Body.Close()
	var rep dumpReply
	if err := json.NewDecoder(resp.Body).Decode(&rep); err != nil {
		return fail(stderr, fmt.Errorf("bad answer from npuprobe at %s: %v", where, err))
	}
	if rep.Error != "" {
		return fail(stderr, errors.New(rep.Error))
	}
	for _, p := range rep.Paths {
		fmt.Fprintln(stdout, p)
	}
	return exitOK
}
