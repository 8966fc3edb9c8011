package main

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Metrics follow Prometheus conventions: base units (bytes), counters end
// in _total, labels name the process (pid, and the rank torchrun gave it)
// and the device. Per-process series disappear when the process exits.
//
// The model is owned by the event loop; the loop publishes a copy of the
// numbers (publish) at every idle moment and after every snapshot, and
// scrapes read the latest copy: a scrape never waits for the loop.

type processMetrics struct {
	PID     int             `json:"pid"`
	Rank    string          `json:"rank,omitempty"`
	Name    string          `json:"name"`
	Level   string          `json:"level"`
	Events  uint64          `json:"events"`
	Devices []deviceMetrics `json:"devices"`
}

type deviceMetrics struct {
	Device         int    `json:"device"`
	ReservedBytes  uint64 `json:"reserved_bytes"`
	AllocatedBytes uint64 `json:"allocated_bytes"`
	ActiveBytes    uint64 `json:"active_bytes"`
	SegmentAllocs  uint64 `json:"segment_allocations"`
	Allocs         uint64 `json:"tensor_allocations"`
	OOMs           uint64 `json:"ooms"`
}

type published struct {
	Status    string           `json:"status"`
	Processes []processMetrics `json:"processes"`
	Waiting   int              `json:"waiting_for_runtime"`
	Dropped   uint64           `json:"dropped_events"`
}

type metrics struct {
	state     atomic.Pointer[published]
	snapshots *prometheus.CounterVec
	failures  prometheus.Counter
	registry  *prometheus.Registry
}

var (
	procLabels   = []string{"pid", "rank"}
	deviceLabels = []string{"pid", "rank", "device"}
	descReserved = prometheus.NewDesc("npuprobe_device_reserved_bytes",
		"Device memory the process holds from the runtime (segments, mapped pages).", deviceLabels, nil)
	descAllocated = prometheus.NewDesc("npuprobe_device_allocated_bytes",
		"Device memory in blocks handed to tensors (tensor level; 0 at segment level).", deviceLabels, nil)
	descActive = prometheus.NewDesc("npuprobe_device_active_bytes",
		"Device memory in blocks in use or awaiting free (tensor level).", deviceLabels, nil)
	descSegAllocs = prometheus.NewDesc("npuprobe_segment_allocations_total",
		"Segments obtained from the runtime (segment_alloc and segment_map entries) since attach.", deviceLabels, nil)
	descAllocs = prometheus.NewDesc("npuprobe_tensor_allocations_total",
		"Blocks handed to tensors (alloc entries) since attach.", deviceLabels, nil)
	descOOMs = prometheus.NewDesc("npuprobe_oom_events_total",
		"Allocations that failed for lack of device memory since attach.", deviceLabels, nil)
	descEvents = prometheus.NewDesc("npuprobe_events_total",
		"Runtime and allocator calls recorded since attach.", procLabels, nil)
	descDropped = prometheus.NewDesc("npuprobe_dropped_events_total",
		"Records lost because the BPF ring buffer was full (state is resynced; trace entries are lost).", nil, nil)
	descTraced = prometheus.NewDesc("npuprobe_traced_processes",
		"Processes being traced.", nil, nil)
	descWaiting = prometheus.NewDesc("npuprobe_waiting_processes",
		"Processes watched until they load the CANN runtime.", nil, nil)
)

func newMetrics() *metrics {
	m := &metrics{
		snapshots: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "npuprobe_snapshots_written_total",
			Help: "Snapshot files written, by reason (signal, request, oom, exit, final)."}, []string{"reason"}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{Name: "npuprobe_snapshot_failures_total",
			Help: "Snapshots that could not be written (full disk, I/O error)."}),
		registry: prometheus.NewRegistry(),
	}
	m.state.Store(&published{})
	m.registry.MustRegister(m, m.snapshots, m.failures,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Describe and Collect make metrics a prometheus.Collector over the
// published numbers.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descReserved, descAllocated, descActive, descSegAllocs, descAllocs, descOOMs, descEvents, descDropped, descTraced, descWaiting} {
		ch <- d
	}
}

func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	st := m.state.Load()
	for _, p := range st.Processes {
		pid := strconv.Itoa(p.PID)
		ch <- prometheus.MustNewConstMetric(descEvents, prometheus.CounterValue, float64(p.Events), pid, p.Rank)
		for _, d := range p.Devices {
			dev := strconv.Itoa(d.Device)
			ch <- prometheus.MustNewConstMetric(descReserved, prometheus.GaugeValue, float64(d.ReservedBytes), pid, p.Rank, dev)
			ch <- prometheus.MustNewConstMetric(descAllocated, prometheus.GaugeValue, float64(d.AllocatedBytes), pid, p.Rank, dev)
			ch <- prometheus.MustNewConstMetric(descActive, prometheus.GaugeValue, float64(d.ActiveBytes), pid, p.Rank, dev)
			ch <- prometheus.MustNewConstMetric(descSegAllocs, prometheus.CounterValue, float64(d.SegmentAllocs), pid, p.Rank, dev)
			ch <- prometheus.MustNewConstMetric(descAllocs, prometheus.CounterValue, float64(d.Allocs), pid, p.Rank, dev)
			ch <- prometheus.MustNewConstMetric(descOOMs, prometheus.CounterValue, float64(d.OOMs), pid, p.Rank, dev)
		}
	}
	ch <- prometheus.MustNewConstMetric(descDropped, prometheus.CounterValue, float64(st.Dropped))
	ch <- prometheus.MustNewConstMetric(descTraced, prometheus.GaugeValue, float64(len(st.Processes)))
	ch <- prometheus.MustNewConstMetric(descWaiting, prometheus.GaugeValue, float64(st.Waiting))
}

func (m *metrics) statusSnapshot() *published { return m.state.Load() }

// publish copies the numbers out of the models (event-loop goroutine only).
func (s *session) publish() {
	st := &published{Status: s.statusText(), Waiting: len(s.watching)}
	if loss, err := s.tracer.Loss(); err == nil {
		st.Dropped = loss.RingBufferFull
	}
	for pid, p := range s.procs {
		pm := processMetrics{PID: int(pid), Rank: p.env["RANK"], Name: p.target.Name, Level: p.model.Level().String(),
			Events: p.model.Stats().Events}
		for dev, d := range p.model.DeviceStats() {
			pm.Devices = append(pm.Devices, deviceMetrics{Device: dev, ReservedBytes: d.ReservedBytes, AllocatedBytes: d.AllocatedBytes,
				ActiveBytes: d.ActiveBytes, SegmentAllocs: d.SegmentAllocs, Allocs: d.Allocs, OOMs: d.OOMs})
		}
		st.Processes = append(st.Processes, pm)
	}
	s.metrics.state.Store(st)
}

// serveMetrics serves /metrics on addr (opt-in: --metrics-addr).
func serveMetrics(m *metrics, addr string) (func(), error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(l)
	return func() { srv.Close() }, nil
}
