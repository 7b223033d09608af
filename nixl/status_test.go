package nixl

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestFromCode(t *testing.T) {
	tests := []struct {
		code int32
		want error // nil: success or in progress
	}{
		{0, nil},
		{1, nil},
		{7, nil}, // positive codes are not errors
		{-1, ErrNotPosted},
		{-2, ErrInvalidParam},
		{-3, ErrBackend},
		{-4, ErrNotFound},
		{-5, ErrMismatch},
		{-6, ErrNotAllowed},
		{-7, ErrRepostActive},
		{-8, ErrUnknown},
		{-9, ErrNotSupported},
		{-10, ErrRemoteDisconnect},
		{-11, ErrCanceled},
	}
	for _, tc := range tests {
		err := FromCode(tc.code)
		if tc.want == nil {
			if err != nil {
				t.Errorf("FromCode(%d) = %v, want nil", tc.code, err)
			}
			continue
		}
		if err != tc.want { // known codes come back as the bare Status
			t.Errorf("FromCode(%d) = %v, want %v", tc.code, err, tc.want)
		}
		if s, ok := err.(Status); !ok || int32(s) != tc.code {
			t.Errorf("FromCode(%d) = %#v, not Status(%d)", tc.code, err, tc.code)
		}
	}
	for _, code := range []int32{-12, -100, -2147483648} {
		err := FromCode(code)
		var e *Error
		if !errors.Is(err, ErrUnknown) || !errors.As(err, &e) || !strings.Contains(err.Error(), fmt.Sprint(code)) {
			t.Errorf("FromCode(%d) = %v, want ErrUnknown naming the code", code, err)
		}
	}
}

func TestStatusString(t *testing.T) {
	tests := []struct {
		s    Status
		want string
	}{
		{InProgress, "NIXL_IN_PROG"},
		{Success, "NIXL_SUCCESS"},
		{ErrNotPosted, "NIXL_ERR_NOT_POSTED"},
		{ErrInvalidParam, "NIXL_ERR_INVALID_PARAM"},
		{ErrBackend, "NIXL_ERR_BACKEND"},
		{ErrNotFound, "NIXL_ERR_NOT_FOUND"},
		{ErrMismatch, "NIXL_ERR_MISMATCH"},
		{ErrNotAllowed, "NIXL_ERR_NOT_ALLOWED"},
		{ErrRepostActive, "NIXL_ERR_REPOST_ACTIVE"},
		{ErrUnknown, "NIXL_ERR_UNKNOWN"},
		{ErrNotSupported, "NIXL_ERR_NOT_SUPPORTED"},
		{ErrRemoteDisconnect, "NIXL_ERR_REMOTE_DISCONNECT"},
		{ErrCanceled, "NIXL_ERR_CANCELED"},
		{Status(-42), "NIXL_STATUS(-42)"},
		{Status(2), "NIXL_STATUS(2)"},
	}
	for _, tc := range tests {
		if got := tc.s.String(); got != tc.want {
			t.Errorf("Status(%d).String() = %q, want %q", int32(tc.s), got, tc.want)
		}
		if got := tc.s.Error(); got != "nixl: "+tc.want {
			t.Errorf("Status(%d).Error() = %q", int32(tc.s), got)
		}
	}
}

func TestErrorWrapping(t *testing.T) {
	err := Errorf(ErrNotFound, "request %d", 17)
	var e *Error
	if !errors.As(err, &e) || e.Status != ErrNotFound || e.Msg != "request 17" {
		t.Fatalf("Errorf gave %#v", err)
	}
	if got, want := err.Error(), "nixl: NIXL_ERR_NOT_FOUND: request 17"; got != want {
		t.Fatalf("Error() = %q, want %q", got, want)
	}
	if !errors.Is(err, ErrNotFound) {
		t.Fatal("errors.Is misses the Status")
	}
	if errors.Is(err, ErrNotAllowed) {
		t.Fatal("errors.Is matches another Status")
	}
	wrapped := fmt.Errorf("layer: %w", err)
	if !errors.Is(wrapped, ErrNotFound) || !errors.As(wrapped, &e) {
		t.Fatal("errors.Is/As fail through another wrap")
	}
	var s Status
	if !errors.As(wrapped, &s) || s != ErrNotFound {
		t.Fatalf("errors.As(Status) = %v", s)
	}
	if errors.Unwrap(err) != ErrNotFound {
		t.Fatal("Unwrap does not return the Status")
	}
}
