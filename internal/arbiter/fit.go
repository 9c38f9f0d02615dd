package arbiter

import "math"

// maxDim is the most coefficients a fit carries: the prefill model has three
// (fixed, per token, per attended position), a link two (latency, per byte).
const maxDim = 3

type vec [maxDim]float64

func (v vec) dot(w vec) float64 { return v[0]*w[0] + v[1]*w[1] + v[2]*w[2] }

// Tuning of the robust fit. Residuals are relative: r = y/ŷ - 1.
const (
	// shapeWeight is how many observations' worth of belief the configured
	// defaults carry about the ratios between coefficients, per unit of
	// relative deviation. Their overall scale carries none, so the first
	// observation alone rescales them; it is small so that data that
	// identifies the shape (a GPU's large fixed cost, a link without
	// latency) overrides it, while directions no data identifies (every
	// prompt of one length) keep the defaults' shape.
	shapeWeight = 0.01
	// initialScale is the median |r| assumed before any data. It is small so
	// that outliers are screened from the first observations, which weigh
	// most while little data is held. A model far off its defaults needs no
	// wide start: the first observation rescales the whole curve, and a
	// lasting misfit shows up as a streak (changeStreak).
	initialScale = 0.03
	// minThreshold keeps ordinary measurement noise (a few percent) from
	// ever being clipped once the scale has settled.
	minThreshold = 0.1
	// thresholdScales is the Huber threshold in units of the running median
	// of |r|: 3σ for normal noise, whose median |r| is 0.6745σ.
	thresholdScales = 4.45
	// scaleGain is the step, as a log factor per observation, of the running
	// median of |r|: it rises when |r| is above it and falls when below, so
	// it settles where half the residuals are, which a few outliers barely
	// move.
	scaleGain = 1.0 / 16
	// changeStreak is how many clipped residuals in a row on the same side
	// mean a lasting change rather than outliers.
	changeStreak = 8
	// singularPivot is the relative pivot below which a subsystem is
	// treated as singular.
	singularPivot = 1e-12
)

// fit estimates y = θ·x with θ >= 0 from a stream of observations. It is a
// weighted least-squares fit over exponentially forgotten sufficient
// statistics, solved exactly as a nonnegative least-squares problem each time
// (at most 2^3 subsystems of size <= 3, so no iteration and no drift).
//
// Three choices keep it stable and scale-free:
//   - Each observation is weighted by 1/ŷ², ŷ the prediction when it
//     arrives, so a 10 µs transfer and a 10 s prefill carry the same
//     weight: the fit minimises relative error. The weight depends on the
//     prediction, not on the noisy measurement, so it adds no bias.
//   - The defaults act as a shape prior only. Coordinates are normalised by
//     them (u = θ/unit) and the penalty is on the part of u perpendicular to
//     the defaults' direction, relative to u's current size. So a machine
//     100x faster than the defaults is fitted as well as one equal to them,
//     and the first observation rescales the whole curve.
//   - Huber weights on the relative residual bound what one outlier can
//     move, however far off it is; the threshold follows a running median of
//     |r|, which the outliers themselves barely move. A run of clipped
//     residuals on one side is not outliers but a lasting change, taken as
//     a rescale of the whole curve.
type fit struct {
	dim     int
	prior   vec // θ0, the configured defaults
	unit    vec // normalisation: θ0 where positive, else a floor
	shaped  vec // 1 where θ0 > 0: the coordinates the shape prior covers
	penalty [maxDim][maxDim]float64
	forget  float64 // per-observation forgetting factor λ

	a         [maxDim][maxDim]float64 // Σ λ^age w h x̃ x̃ᵀ
	b         vec                     // Σ λ^age w h x̃ y
	theta     vec
	scale     float64 // running median of |r|
	streak    int     // clipped residuals in a row on one side, signed by the side
	streakLog float64 // Σ ln(y/ŷ) over the streak
}

// newFit returns a fit of dim coefficients that predicts prior until it sees
// data. floor gives the unit of a coordinate whose default is zero; such a
// coordinate is free of the shape prior and only data moves it off zero.
func newFit(dim int, prior, floor vec, window int) fit {
	f := fit{dim: dim, prior: prior, theta: prior, scale: initialScale, forget: 1 - 1/float64(window)}
	n := 0.0
	for j := 0; j < dim; j++ {
		f.unit[j] = floor[j]
		if prior[j] > 0 {
			f.unit[j] = prior[j]
			f.shaped[j] = 1
			n++
		}
	}
	// shapeWeight·(D - v̂v̂ᵀ), D the diagonal of shaped, v̂ = shaped/√n.
	for i := 0; i < dim; i++ {
		for j := 0; j < dim; j++ {
			p := -f.shaped[i] * f.shaped[j] / n
			if i == j {
				p += f.shaped[i]
			}
			f.penalty[i][j] = shapeWeight * p
		}
	}
	return f
}

func (f *fit) predict(x vec) float64 { return f.theta.dot(x) }

// forgetData scales the data's weight by factor in (0, 1].
func (f *fit) forgetData(factor float64) {
	for i := 0; i < f.dim; i++ {
		for j := 0; j < f.dim; j++ {
			f.a[i][j] *= factor
		}
		f.b[i] *= factor
	}
}

// observe adds y measured at x, ignoring a y that is not positive and
// finite. However far off y is, its pull on the fit is bounded by the Huber
// threshold.
func (f *fit) observe(x vec, y float64) {
	pred := f.predict(x)
	if !(pred > 0) {
		pred = f.prior.dot(x)
	}
	ratio := y / pred
	if !(ratio > 0) || math.IsInf(ratio, 0) {
		return
	}
	saved := *f
	threshold := max(minThreshold, thresholdScales*f.scale)
	if c := f.trackStreak(ratio, threshold); c != 1 {
		f.rescale(c)
		pred *= c
		ratio /= c
	}
	r := math.Abs(ratio - 1)
	h := 1.0
	if r > threshold {
		h = threshold / r
	}
	if r > f.scale {
		f.scale *= math.Exp(scaleGain)
	} else {
		f.scale *= math.Exp(-scaleGain)
	}

	f.forgetData(f.forget)
	w := h / (pred * pred)
	var xt vec
	for j := 0; j < f.dim; j++ {
		xt[j] = x[j] * f.unit[j]
	}
	for i := 0; i < f.dim; i++ {
		for j := 0; j < f.dim; j++ {
			f.a[i][j] += w * xt[i] * xt[j]
		}
		f.b[i] += w * xt[i] * y
	}
	u, ok := f.solve()
	if !ok {
		*f = saved
		return
	}
	for j := 0; j < f.dim; j++ {
		f.theta[j] = u[j] * f.unit[j]
	}
}

// trackStreak counts residuals beyond threshold that fall on the same side
// in a row. Outliers do not line up like that by chance: after changeStreak
// of them the machine or link has changed, and trackStreak returns the
// change as a factor (the streak's geometric mean ratio); otherwise 1.
func (f *fit) trackStreak(ratio, threshold float64) float64 {
	side := 1
	if ratio < 1 {
		side = -1
	}
	switch {
	case math.Abs(ratio-1) <= threshold:
		f.streak, f.streakLog = 0, 0
		return 1
	case f.streak*side < 0:
		f.streak, f.streakLog = 0, 0
	}
	f.streak += side
	f.streakLog += math.Log(ratio)
	if f.streak*side < changeStreak {
		return 1
	}
	c := math.Exp(f.streakLog / changeStreak)
	f.streak, f.streakLog = 0, 0
	return c
}

// rescale takes a change of the whole curve by factor c: the estimate and
// the data are rescaled as if every past observation had been c times
// longer, so the data keeps teaching the curve's shape at the new scale
// instead of holding the estimate back for a window's worth of
// observations. Weights are 1/ŷ², so a scales by 1/c² and b by 1/c.
func (f *fit) rescale(c float64) {
	for i := 0; i < f.dim; i++ {
		for j := 0; j < f.dim; j++ {
			f.a[i][j] /= c * c
		}
		f.b[i] /= c
		f.theta[i] *= c
	}
}

// solve minimises uᵀMu - 2bᵀu over u >= 0, M = penalty/|u|² + a (|u| the
// current size, making the shape penalty relative), by trying every
// support set: the minimiser solves M_SS u_S = b_S on its support, and
// among the candidates that come out nonnegative the lowest objective is
// the optimum (M is positive semidefinite; a minimiser with a nonsingular
// M_SS always exists, so singular subsystems can be skipped).
func (f *fit) solve() (vec, bool) {
	m := f.system()
	var best vec
	bestObj := 0.0 // u = 0, the empty support, which predicts nothing
	found := false
	for support := 1; support < 1<<f.dim; support++ {
		u, ok := solveSubset(&m, &f.b, f.dim, support)
		if !ok {
			continue
		}
		obj := -f.b.dot(u) // at a stationary point uᵀMu = bᵀu
		if obj < bestObj {
			best, bestObj, found = u, obj, true
		}
	}
	for j := 0; j < f.dim; j++ {
		if math.IsInf(best[j], 0) {
			return vec{}, false
		}
	}
	return best, found
}

// system is M: the shape penalty scaled to the current size of u, plus the data.
func (f *fit) system() [maxDim][maxDim]float64 {
	size := 0.0
	for j := 0; j < f.dim; j++ {
		u := f.theta[j] / f.unit[j]
		size += u * u
	}
	size /= float64(f.dim)
	var m [maxDim][maxDim]float64
	for i := 0; i < f.dim; i++ {
		for j := 0; j < f.dim; j++ {
			m[i][j] = f.penalty[i][j]/size + f.a[i][j]
		}
	}
	return m
}

// solveSubset solves M_SS u_S = b_S by Cholesky for the coordinates in the
// bit set support, returning u zero outside it. It fails when M_SS is
// numerically singular or the solution has a negative coordinate.
func solveSubset(m *[maxDim][maxDim]float64, b *vec, dim, support int) (vec, bool) {
	var idx [maxDim]int
	n := 0
	for j := 0; j < dim; j++ {
		if support&(1<<j) != 0 {
			idx[n] = j
			n++
		}
	}
	var l [maxDim][maxDim]float64
	maxDiag := 0.0
	for i := 0; i < n; i++ {
		maxDiag = max(maxDiag, m[idx[i]][idx[i]])
	}
	if !(maxDiag > 0) || math.IsInf(maxDiag, 0) {
		return vec{}, false
	}
	for i := 0; i < n; i++ {
		for j := 0; j <= i; j++ {
			s := m[idx[i]][idx[j]]
			for k := 0; k < j; k++ {
				s -= l[i][k] * l[j][k]
			}
			if i == j {
				if s <= singularPivot*maxDiag {
					return vec{}, false
				}
				l[i][i] = math.Sqrt(s)
			} else {
				l[i][j] = s / l[j][j]
			}
		}
	}
	var z, y vec
	for i := 0; i < n; i++ {
		s := b[idx[i]]
		for k := 0; k < i; k++ {
			s -= l[i][k] * z[k]
		}
		z[i] = s / l[i][i]
	}
	for i := n - 1; i >= 0; i-- {
		s := z[i]
		for k := i + 1; k < n; k++ {
			s -= l[k][i] * y[k]
		}
		y[i] = s / l[i][i]
	}
	var u vec
	for i := 0; i < n; i++ {
		if !(y[i] >= 0) {
			return vec{}, false
		}
		u[idx[i]] = y[i]
	}
	return u, true
}
