package allocmodel

import (
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"strings"
)

// Constants of torch_npu's caching allocator (NPUCachingAllocator.cpp).
const (
	minBlockSize = 512     // kMinBlockSize: every block is a multiple
	smallSize    = 1 << 20 // kSmallSize: largest request served by the small pool
	smallBuffer  = 2 << 20 // kSmallBuffer: small-pool segment size
	// padSize is what torch_npu adds to every request (AddPadSize()):
	// 32, except on Ascend 950 with CANN 9.1 or newer, where it is 0.
	padSize = 32
	// roundupDivisionSlots is the length of roundup_power2_divisions:
	// one slot per power of two from 1 MiB up.
	roundupDivisionSlots = 16
)

// AllocConf is the part of a process's allocator configuration
// (PYTORCH_NPU_ALLOC_CONF or PYTORCH_ALLOC_CONF) that changes which blocks
// the caching allocator creates. Keys that only change when or whether
// memory is obtained (large_segment_size_mb, max_non_split_rounding_mb,
// garbage_collection_threshold, ...) need not be modelled: those outcomes
// are observed.
type AllocConf struct {
	// Source is the variable the configuration came from, "" if none.
	Source string
	// Raw is its value.
	Raw string
	// MaxSplitSize: blocks at least this large are not split for smaller
	// requests. Unlimited by default.
	MaxSplitSize uint64
	// RoundupDivisions[i] is the number of divisions per power of two for
	// requests in [2^(20+i), 2^(21+i)), i clamped to [0, 15]; 0 or 1 means
	// plain 512-byte rounding.
	RoundupDivisions [roundupDivisionSlots]uint64
	// ExpandableSegments is expandable_segments:True.
	ExpandableSegments bool
	// BaseAddrAlignedKB is base_addr_aligned_kb (expandable segments only).
	BaseAddrAlignedKB uint64
	// Pad is the padding added to every request; 32 (AddPadSize) unless set.
	Pad uint64
}

// DefaultAllocConf is torch_npu's configuration when no variable is set.
func DefaultAllocConf() AllocConf {
	return AllocConf{MaxSplitSize: math.MaxUint64, BaseAddrAlignedKB: 16, Pad: padSize}
}

// AllocConfFromEnv reads the allocator configuration from a process's
// environment the way torch_npu does: PYTORCH_NPU_ALLOC_CONF, or (torch_npu
// 2.10 and later) PYTORCH_ALLOC_CONF. torch_npu refuses to start with both
// set, so a running process has at most one.
func AllocConfFromEnv(env map[string]string) (AllocConf, error) {
	for _, name := range []string{"PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} {
		if v, ok := env[name]; ok && v != "" {
			c, err := ParseAllocConf(v)
			if err != nil {
				return DefaultAllocConf(), fmt.Errorf("%s=%q: %w", name, v, err)
			}
			c.Source = name
			return c, nil
		}
	}
	return DefaultAllocConf(), nil
}

// ParseAllocConf parses "key:value,key:value". Keys the model does not need
// are accepted and ignored; a malformed value of a key it needs is an error.
func ParseAllocConf(s string) (AllocConf, error) {
	c := DefaultAllocConf()
	c.Raw = s
	for _, item := range splitConf(s) {
		key, val, ok := strings.Cut(item, ":")
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		if !ok || key == "" {
			return c, fmt.Errorf("option %q is not key:value", item)
		}
		switch key {
		case "max_split_size_mb":
			mb, err := strconv.ParseUint(val, 10, 64)
			if err != nil {
				return c, fmt.Errorf("max_split_size_mb: %w", err)
			}
			c.MaxSplitSize = mb << 20
		case "roundup_power2_divisions":
			if err := parseDivisions(val, &c.RoundupDivisions); err != nil {
				return c, fmt.Errorf("roundup_power2_divisions: %w", err)
			}
		case "expandable_segments":
			switch val {
			case "True":
				c.ExpandableSegments = true
			case "False":
				c.ExpandableSegments = false
			default:
				return c, fmt.Errorf("expandable_segments: want True or False, got %q", val)
			}
		case "base_addr_aligned_kb":
			kb, err := strconv.ParseUint(val, 10, 64)
			if err != nil || kb > 16 {
				return c, fmt.Errorf("base_addr_aligned_kb: want 0..16, got %q", val)
			}
			c.BaseAddrAlignedKB = kb
		}
	}
	return c, nil
}

// splitConf splits on commas outside brackets ("[1:2,>:4]" is one value).
func splitConf(s string) []string {
	var out []string
	depth, start := 0, 0
	for i, r := range s {
		switch r {
		case '[':
			depth++
		case ']':
			depth--
		case ',':
			if depth == 0 {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	if strings.TrimSpace(s[start:]) != "" {
		out = append(out, s[start:])
	}
	return out
}

// parseDivisions handles the single form ("4": every slot) and the list form
// ("[256:1,512:2,>:8]": boundaries in MiB, powers of two; the first entry
// also fills every lower slot; ">" fills every slot after the last).
func parseDivisions(val string, slots *[roundupDivisionSlots]uint64) error {
	isPow2 := func(v uint64) bool { return v != 0 && v&(v-1) == 0 }
	if !strings.HasPrefix(val, "[") {
		v, err := strconv.ParseUint(val, 10, 64)
		if err != nil {
			return err
		}
		if v != 0 && !isPow2(v) {
			return fmt.Errorf("%d is not a power of two", v)
		}
		for i := range slots {
			slots[i] = v
		}
		return nil
	}
	if !strings.HasSuffix(val, "]") {
		return fmt.Errorf("unterminated list %q", val)
	}
	first, last := true, -1
	for _, pair := range strings.Split(val[1:len(val)-1], ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(pair), ":")
		if !ok {
			return fmt.Errorf("entry %q is not size:divisions", pair)
		}
		div, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		if err != nil || (div != 0 && !isPow2(div)) {
			return fmt.Errorf("divisions %q must be 0 or a power of two", v)
		}
		k = strings.TrimSpace(k)
		if k == ">" {
			for i := last + 1; i < roundupDivisionSlots; i++ {
				slots[i] = div
			}
			continue
		}
		mb, err := strconv.ParseUint(k, 10, 64)
		if err != nil || !isPow2(mb) {
			return fmt.Errorf("size %q must be a power of two (MiB)", k)
		}
		idx := min(bits.Len64(mb)-1, roundupDivisionSlots-1)
		if first {
			for i := 0; i < idx; i++ {
				slots[i] = div
			}
			first = false
		}
		slots[idx] = div
		last = idx
	}
	return nil
}

// divisionsFor is c10's roundup_power2_divisions(size): the slot of the
// power of two at or below size, counted from 1 MiB.
func (c *AllocConf) divisionsFor(size uint64) uint64 {
	idx := 0
	if size > 0 {
		idx = max(0, bits.Len64(size)-1-20)
	}
	return c.RoundupDivisions[min(idx, roundupDivisionSlots-1)]
}

// RoundSize is torch_npu's round_size: the block size a request of orig
// bytes occupies.
func (c *AllocConf) RoundSize(orig uint64) uint64 {
	size := orig + c.Pad
	if size < minBlockSize {
		return minBlockSize
	}
	if d := c.divisionsFor(size); d > 1 && size > minBlockSize*d {
		return roundupPower2NextDivision(size, d)
	}
	return (size + minBlockSize - 1) / minBlockSize * minBlockSize
}

// roundupPower2NextDivision rounds size up to the next of divisions equal
// steps between the powers of two around it.
func roundupPower2NextDivision(size, divisions uint64) uint64 {
	if size&(size-1) == 0 {
		return size
	}
	floor := uint64(1) << (bits.Len64(size) - 1)
	step := floor >> (bits.Len64(divisions) - 1)
	if step == 0 {
		return floor * 2
	}
	if size&(step-1) == 0 {
		return size
	}
	return (size &^ (step - 1)) + step
}

// isSmallRequest says whether a rounded size is served by the small pool.
func isSmallRequest(rounded uint64) bool { return rounded <= smallSize }

// shouldSplit is torch_npu's should_split for a free block of blockSize
// serving a request of rounded size.
func (c *AllocConf) shouldSplit(small bool, blockSize, size uint64) bool {
	remaining := blockSize - size
	if small || c.ExpandableSegments {
		return remaining >= minBlockSize
	}
	return size < c.MaxSplitSize && remaining > smallSize
}
