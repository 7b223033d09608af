package ring

import "runtime"

func yieldNow() { runtime.Gosched() }
