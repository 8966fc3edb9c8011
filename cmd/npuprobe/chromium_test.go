package main

import (
	"context"
	"image"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// chromiumNames are the executables tried, in order, after $NPUPROBE_CHROMIUM.
var chromiumNames = []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome-headless-shell"}

func findChromium() string {
	if p := os.Getenv("NPUPROBE_CHROMIUM"); p != "" {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	for _, name := range chromiumNames {
		if path, err := exec.LookPath(name); err == nil {
			return path
		}
	}
	return ""
}

// chromium returns a headless browser for the screenshot test. It is
// required: CI must install Debian's chromium (tests/run does). When it is
// missing and we are root with apt-get, the test installs it; otherwise it
// fails saying what to install.
func chromium(t *testing.T) string {
	t.Helper()
	if p := findChromium(); p != "" {
		return p
	}
	var log strings.Builder
	if _, err := exec.LookPath("apt-get"); err == nil && os.Geteuid() == 0 {
		t.Log("chromium not found: installing Debian's chromium package with apt-get")
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		defer cancel()
		for _, args := range [][]string{{"update", "-qq"}, {"install", "-y", "-qq", "chromium"}} {
			cmd := exec.CommandContext(ctx, "apt-get", args...)
			cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
			out, err := cmd.CombinedOutput()
			log.Write(out)
			if err != nil {
				log.WriteString("apt-get " + strings.Join(args, " ") + ": " + err.Error() + "\n")
				break
			}
		}
		if p := findChromium(); p != "" {
			return p
		}
	}
	t.Fatalf("the plot screenshot test needs a headless Chromium and none was found (tried $NPUPROBE_CHROMIUM, %s) "+
		"and it could not be installed: install Debian's chromium package (apt-get install chromium), or point NPUPROBE_CHROMIUM at a Chrome/Chromium binary\n%s",
		strings.Join(chromiumNames, ", "), log.String())
	return ""
}

// screenshot renders page (a local HTML file) at 1200x900 in headless
// Chromium and returns the decoded PNG.
func screenshot(t *testing.T, browser, page string) image.Image {
	t.Helper()
	dir := t.TempDir()
	png1 := filepath.Join(dir, "shot.png")
	profile := filepath.Join(dir, "profile")
	abs, err := filepath.Abs(page)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
		"--hide-scrollbars", "--force-device-scale-factor=1", "--user-data-dir="+profile,
		"--screenshot="+png1, "--window-size=1200,900", "file://"+abs)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", browser, err, out)
	}
	f, err := os.Open(png1)
	if err != nil {
		t.Fatalf("no screenshot from %s: %v\n%s", browser, err, out)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	if keep := os.Getenv("NPUPROBE_KEEP_SCREENSHOT"); keep != "" {
		data, _ := os.ReadFile(png1)
		os.WriteFile(keep, data, 0o644)
	}
	return img
}

// rgb parses "#rrggbb".
func rgb(hex string) [3]int {
	var c [3]int
	for i := range c {
		var v int
		for _, ch := range hex[1+2*i : 3+2*i] {
			v <<= 4
			switch {
			case ch >= '0' && ch <= '9':
				v |= int(ch - '0')
			default:
				v |= int(ch-'a') + 10
			}
		}
		c[i] = v
	}
	return c
}

// near reports whether the pixel at x, y is within tol (sum of channel
// differences) of colour c.
func near(img image.Image, x, y int, c [3]int, tol int) bool {
	r, g, b, _ := img.At(x, y).RGBA()
	d := abs(int(r>>8)-c[0]) + abs(int(g>>8)-c[1]) + abs(int(b>>8)-c[2])
	return d <= tol
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

// plotArea finds the bounding box of the long horizontal runs (at least
// minRun pixels) of colour c: the chart's plot background, which text
// anti-aliasing elsewhere on the page cannot imitate.
func plotArea(img image.Image, c [3]int, minRun int) image.Rectangle {
	var r image.Rectangle
	first := true
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		run := 0
		for x := b.Min.X; x <= b.Max.X; x++ {
			if x < b.Max.X && near(img, x, y, c, 0) {
				run++
				continue
			}
			if run >= minRun {
				p := image.Rect(x-run, y, x, y+1)
				if first {
					r, first = p, false
				} else {
					r = r.Union(p)
				}
			}
			run = 0
		}
	}
	return r
}
