package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"reflect"
	"testing"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"
)

// checkGopickleAgrees loads path with gopickle and requires the result to
// equal what python3's pickle loaded (the checker's JSON dump), so two
// independent unpicklers read the same snapshot.
func checkGopickleAgrees(t *testing.T, path string, pythonJSON []byte) {
	t.Helper()
	v, err := pickle.Load(path)
	if err != nil {
		t.Fatalf("gopickle cannot load %s: %v", path, err)
	}
	fromGo, err := generic(v)
	if err != nil {
		t.Fatalf("gopickle result: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(pythonJSON))
	dec.UseNumber()
	var fromPy any
	if err := dec.Decode(&fromPy); err != nil {
		t.Fatal(err)
	}
	fromPy = fromJSON(fromPy)
	if !reflect.DeepEqual(fromGo, fromPy) {
		t.Fatalf("gopickle and python3 read %s differently", path)
	}
}

// generic turns gopickle's types into plain Go values.
func generic(v any) (any, error) {
	switch v := v.(type) {
	case *types.Dict:
		m := make(map[string]any, v.Len())
		for _, e := range *v {
			k, ok := e.Key.(string)
			if !ok {
				return nil, fmt.Errorf("dict key %T, want str", e.Key)
			}
			g, err := generic(e.Value)
			if err != nil {
				return nil, err
			}
			m[k] = g
		}
		return m, nil
	case *types.List:
		return genericSlice(*v)
	case *types.Tuple:
		return genericSlice(*v)
	case int:
		return int64(v), nil
	case *big.Int:
		if !v.IsInt64() {
			return nil, fmt.Errorf("integer %v out of int64 range", v)
		}
		return v.Int64(), nil
	case string, bool, float64, nil:
		return v, nil
	}
	return nil, fmt.Errorf("unexpected pickled type %T", v)
}

func genericSlice(items []any) (any, error) {
	out := make([]any, len(items))
	for i, it := range items {
		g, err := generic(it)
		if err != nil {
			return nil, err
		}
		out[i] = g
	}
	return out, nil
}

func fromJSON(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			v[k] = fromJSON(e)
		}
		return v
	case []any:
		for i, e := range v {
			v[i] = fromJSON(e)
		}
		return v
	case json.Number:
		if n, err := v.Int64(); err == nil {
			return n
		}
		f, _ := v.Float64()
		return f
	}
	return v
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
