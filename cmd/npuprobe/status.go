package main

import (
	"fmt"
	"io"
	"time"
)

// statusLine prints a one-line live status. On a terminal it rewrites one
// line in place; otherwise (a log file, a container's stderr) it prints a
// full line at a slower interval so logs stay readable.
type statusLine struct {
	w        io.Writer
	tty      bool
	interval time.Duration
	last     time.Time
	shown    bool // a line is on screen without a newline
}

func (l *statusLine) maybePrint(text func() string) {
	if l == nil || l.interval <= 0 || time.Since(l.last) < l.interval {
		return
	}
	l.last = time.Now()
	if l.tty {
		fmt.Fprintf(l.w, "\r\x1b[K%s", text())
		l.shown = true
	} else {
		fmt.Fprintln(l.w, text())
	}
}

// clear removes an in-place line before other output is printed.
func (l *statusLine) clear() {
	if l != nil && l.shown {
		fmt.Fprint(l.w, "\r\x1b[K")
		l.shown = false
	}
}
