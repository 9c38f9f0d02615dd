package status

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestErrorText(t *testing.T) {
	inner := Errorf(Timeout, "open segment %q", "peer")
	assert.Equal(t, Timeout.String()+`: open segment "peer"`, inner.Error())
	assert.Equal(t, Timeout.String()+`: opening segment peer: open segment "peer"`, Wrap(Timeout, inner, "opening segment peer").Error(),
		"a wrapped error of the same status does not repeat it")
	assert.Equal(t, Transfer.String()+": block 3: "+inner.Error(), Wrap(Transfer, inner, "block 3").Error(),
		"another status is kept")
	assert.Equal(t, Transfer.String()+": load: eof", Wrap(Transfer, errors.New("eof"), "load").Error())
	assert.Equal(t, Transfer.String()+": eof", Wrap(Transfer, errors.New("eof"), "").Error())
	assert.Equal(t, Timeout, Of(Wrap(Timeout, inner, "x")))
}
