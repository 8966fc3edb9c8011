module github.com/npuprobe/npuprobe

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	github.com/nlpodyssey/gopickle v0.2.0
	github.com/spf13/pflag v1.1.0
	golang.org/x/sys v0.50.0
	golang.org/x/term v0.48.0
)

require golang.org/x/arch v0.33.0 // indirect

tool github.com/cilium/ebpf/cmd/bpf2go
